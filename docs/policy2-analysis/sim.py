import json, sys, heapq, collections
reqs=[json.loads(l) for l in open('/work/shared/traces/mooncake_conversation_trace.jsonl')]
PT=64; PPB=8
keys=[]
for r in reqs:
    ids=r['hash_ids']; n=min(r['input_length']//PT, PPB*len(ids))
    keys.append([ids[j//PPB]*PPB + j%PPB for j in range(n)])
TOTAL=sum(map(len,keys))
print('pages',TOTAL, file=sys.stderr)

def run(cap, admit, prio):
    """admit(h, n, req_idx) -> max depth (exclusive) to admit; prio: 'lru' recency heap keyed by score fn"""
    res={}  # page -> score
    heap=[]
    tick=0; hits=0
    for ri,k in enumerate(keys):
        h=0
        for p in k:
            if p in res: h+=1
            else: break
        hits+=h
        for d in range(h):
            tick+=1; s=prio(tick,d,ri,True); res[k[d]]=s; heapq.heappush(heap,(s,k[d]))
        lim=admit(h,len(k),ri)
        missing=[]
        for d in range(h,len(k)):
            p=k[d]
            if p in res:
                tick+=1; s=prio(tick,d,ri,True); res[p]=s; heapq.heappush(heap,(s,p))
            elif d<lim: missing.append((d,p))
        take=min(len(missing),cap)
        need=len(res)+take-cap
        while need>0:
            s,p=heapq.heappop(heap)
            if res.get(p)==s: del res[p]; need-=1
        for d,p in missing[:take]:
            tick+=1; s=prio(tick,d,ri,False); res[p]=s; heapq.heappush(heap,(s,p))
        if len(heap)>4*cap+10000:
            heap=[(s,p) for p,s in res.items()]; heapq.heapify(heap)
    return hits/TOTAL

lru=lambda t,d,ri,hit:t
if __name__=='__main__':
    cap=int(sys.argv[1]) if len(sys.argv)>1 else 9952
    print('lru',run(cap,lambda h,n,ri:n,lru))
    for K in [8,16,32,64]:
        print('lru admit h+%d'%K,run(cap,lambda h,n,ri:h+K,lru))
