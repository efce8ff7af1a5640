import json, collections
reqs=[json.loads(l) for l in open('/work/shared/traces/mooncake_conversation_trace.jsonl')]
N=len(reqs)
# next reuse of request i: next j whose ids share >=2 leading blocks with i (i.e., ids[1] equal)
# conversation key = ids[1] (second block) if exists
byk=collections.defaultdict(list)
for i,r in enumerate(reqs):
    ids=r['hash_ids']
    if len(ids)>1: byk[ids[1]].append(i)
nxt=[None]*N; turn=[0]*N
for k,l in byk.items():
    for a,b in zip(l,l[1:]): nxt[a]=b
    for t,i in enumerate(l): turn[i]=t
sizes=collections.Counter(len(l) for l in byk.values())
print('convs',len(byk),'turn count dist',sorted(sizes.items())[:15])
stats=collections.defaultdict(lambda:[0,0,[]])
for i in range(N):
    t=min(turn[i],5)
    s=stats[t]; s[0]+=1
    if nxt[i] is not None: s[1]+=1; s[2].append(nxt[i]-i)
for t in sorted(stats):
    n,m,g=stats[t]; g.sort()
    print('turn',t,'n',n,'P(reused)',round(m/n,3),'gap med',g[len(g)//2] if g else None, 'p25',g[len(g)//4] if g else None)
# blocks: value — sum of len(ids of i) reused when next turn happens
# does prompt length predict reuse?
for lo,hi in [(1,4),(4,8),(8,16),(16,32),(32,64),(64,300)]:
    sel=[i for i in range(N) if lo<=len(reqs[i]['hash_ids'])<hi]
    m=sum(1 for i in sel if nxt[i] is not None)
    g=sorted(nxt[i]-i for i in sel if nxt[i] is not None)
    print('len',lo,hi,'n',len(sel),'P',round(m/max(1,len(sel)),3),'gapmed',g[len(g)//2] if g else None)
# check prefix property: does next turn share all of i's ids?
full=sum(1 for i in range(N) if nxt[i] is not None and reqs[nxt[i]]['hash_ids'][:len(reqs[i]['hash_ids'])-1]==reqs[i]['hash_ids'][:-1])
print('next turn contains all but last block', full, sum(1 for x in nxt if x is not None))
