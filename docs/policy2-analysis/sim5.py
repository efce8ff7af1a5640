import sys, heapq, collections
sys.argv=[sys.argv[0]]
exec(open('docs/policy2-analysis/sim.py').read().split("lru=lambda")[0])
pred={}
for k in keys:
    for d in range(1,len(k)): pred[k[d]]=k[d-1]
def run5(cap, W=8*9952, depthw=2, minc=0, KK=0, orphan_first=False, report=False, tunit='touch'):
    res={}; heap=[]; tick=0; hits=0; cnt=collections.Counter(); orph=[]; rq=0
    def touch(p,d):
        nonlocal tick
        if tunit=='touch': tick+=1
        cnt[p]+=1
        t = tick if tunit=='touch' else rq*188
        s=t+W*min(cnt[p],15)-depthw*d
        res[p]=s; heapq.heappush(heap,(s,p))
    for ri,k in enumerate(keys):
        rq=ri
        h=0
        for p in k:
            if p in res: h+=1
            else: break
        hits+=h
        for d in range(h): touch(k[d],d)
        missing=[]; stop=False
        for d in range(h,len(k)):
            p=k[d]
            if p in res: touch(p,d)
            elif not stop and (cnt[p]>=minc or d<h+KK): missing.append((d,p))
            else: stop=True; cnt[p]+=1
        take=min(len(missing),cap)
        need=len(res)+take-cap
        if orphan_first and need>0:
            # evict orphans first
            orphans=[p for p in res if p in pred and pred[p] not in res]
            # iterative: remove orphans, their successors become orphans later
            for p in orphans:
                if need<=0: break
                del res[p]; need-=1
        while need>0:
            s,p=heapq.heappop(heap)
            if res.get(p)==s: del res[p]; need-=1
        for d,p in missing[:take]: touch(p,d)
        if len(heap)>4*cap+10000:
            heap=[(s,p) for p,s in res.items()]; heapq.heapify(heap)
        if report and ri%1000==999:
            o=sum(1 for p in res if p in pred and pred[p] not in res); orph.append(o)
    if report: print('orphans',orph)
    return hits/TOTAL
if __name__=='__main__':
    cap=int(sys.argv[1]) if len(sys.argv)>1 else 9952
    for a in eval(open('docs/policy2-analysis/cfg5').read()):
        print(a, round(run5(cap,**a),4), flush=True)
