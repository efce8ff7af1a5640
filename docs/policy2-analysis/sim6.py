import sys
exec(open('docs/policy2-analysis/sim5.py').read().split("if __name__")[0])
exec(open('docs/policy2-analysis/sim3.py').read().split("def run3")[0].split("exec(")[0])
INF=10**9
nextuse=[None]*len(keys); seen={}
for ri in range(len(keys)-1,-1,-1):
    nextuse[ri]=[seen.get(p,INF) for p in keys[ri]]
    for p in keys[ri]: seen[p]=ri
# oracle admission + prefix-lfu score
def run6(cap,T,W=8*9952,depthw=2):
    res={}; heap=[]; tick=0; hits=0; cnt=collections.Counter()
    def touch(p,d):
        nonlocal tick
        tick+=1; cnt[p]+=1; s=tick+W*min(cnt[p],15)-depthw*d; res[p]=s; heapq.heappush(heap,(s,p))
    for ri,k in enumerate(keys):
        nu=nextuse[ri]; h=0
        for p in k:
            if p in res: h+=1
            else: break
        hits+=h
        for d in range(h): touch(k[d],d)
        missing=[]; stop=False
        for d in range(h,len(k)):
            p=k[d]
            if p in res: touch(p,d)
            elif not stop and nu[d]<INF and nu[d]-ri<T: missing.append((d,p))
            else: stop=True; cnt[p]+=1
        take=min(len(missing),cap); need=len(res)+take-cap
        while need>0:
            s,p=heapq.heappop(heap)
            if res.get(p)==s: del res[p]; need-=1
        for d,p in missing[:take]: touch(p,d)
        if len(heap)>4*cap+10000:
            heap=[(s,p) for p,s in res.items()]; heapq.heapify(heap)
    return hits/TOTAL
for T in [INF,1000]: print('oracle-admit(reused, gap<%d) + prefix-lfu score'%T, round(run6(9952,T),4), flush=True)
