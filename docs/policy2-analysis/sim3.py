import sys, heapq, collections
sys.argv=[sys.argv[0]]
exec(open('docs/policy2-analysis/sim.py').read().split("lru=lambda")[0])
INF=10**9
nextuse=[None]*len(keys); seen={}
for ri in range(len(keys)-1,-1,-1):
    nextuse[ri]=[seen.get(p,INF) for p in keys[ri]]
    for p in keys[ri]: seen[p]=ri
def run3(cap, T=INF, evict='lru'):
    res={}; heap=[]; tick=0; hits=0
    for ri,k in enumerate(keys):
        nu=nextuse[ri]
        h=0
        for p in k:
            if p in res: h+=1
            else: break
        hits+=h
        def sc(d): return tick if evict=='lru' else -nu[d]
        for d in range(h):
            tick+=1; s=sc(d); res[k[d]]=s; heapq.heappush(heap,(s,k[d]))
        missing=[]; stop=False
        for d in range(h,len(k)):
            p=k[d]
            if p in res:
                tick+=1; s=sc(d); res[p]=s; heapq.heappush(heap,(s,p))
            elif not stop and nu[d]-ri<T and nu[d]<INF: missing.append((d,p))
            else: stop=True
        take=min(len(missing),cap)
        need=len(res)+take-cap
        while need>0:
            s,p=heapq.heappop(heap)
            if res.get(p)==s: del res[p]; need-=1
        for d,p in missing[:take]:
            tick+=1; s=sc(d); res[p]=s; heapq.heappush(heap,(s,p))
        if len(heap)>4*cap+10000:
            heap=[(s,p) for p,s in res.items()]; heapq.heapify(heap)
    return hits/TOTAL
for T in [INF]:
    print('oracle admit nextuse<',T,'LRU evict', round(run3(9952,T),4),flush=True)
