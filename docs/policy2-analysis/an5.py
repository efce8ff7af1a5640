import json, collections, math
reqs=[json.loads(l) for l in open('/work/shared/traces/mooncake_conversation_trace.jsonl')]
byk=collections.defaultdict(list)
for i,r in enumerate(reqs):
    ids=r['hash_ids']
    if len(ids)>1: byk[ids[1]].append(i)
rows=[]
for l in byk.values():
    for t in range(len(l)):
        i=l[t]; j=l[t+1] if t+1<len(l) else None
        prevgap=(i-l[t-1]) if t>0 else None
        growth=len(reqs[i]['hash_ids'])-(len(reqs[l[t-1]]['hash_ids']) if t>0 else 0)
        rows.append(dict(i=i,turn=t,gap=(j-i) if j else None,prevgap=prevgap,L=len(reqs[i]['hash_ids']),growth=growth,out=reqs[i]['output_length'],inp=reqs[i]['input_length']))
def corr(f):
    xs=[];ys=[]
    for r in rows:
        if r['gap'] is None: continue
        x=f(r)
        if x is None: continue
        xs.append(x); ys.append(math.log(r['gap']))
    mx=sum(xs)/len(xs); my=sum(ys)/len(ys)
    c=sum((x-mx)*(y-my) for x,y in zip(xs,ys)); vx=sum((x-mx)**2 for x in xs); vy=sum((y-my)**2 for y in ys)
    return round(c/math.sqrt(vx*vy),3), len(xs)
for name,f in [('turn',lambda r:r['turn']),('logprevgap',lambda r:math.log(r['prevgap']) if r['prevgap'] else None),('logL',lambda r:math.log(r['L'])),('loggrowth',lambda r:math.log(max(1,r['growth']))),('logout',lambda r:math.log(1+r['out'])),('pos',lambda r:r['i']),('inp_mod512',lambda r:r['inp']%512)]:
    print(name,corr(f))
# P(reuse) vs features
def prob(f,bins):
    for lo,hi in bins:
        s=[r for r in rows if f(r) is not None and lo<=f(r)<hi]
        m=[r for r in s if r['gap'] is not None]
        g=sorted(r['gap'] for r in m)
        if s: print('  ',lo,hi,len(s),'P',round(len(m)/len(s),3),'gapmed',g[len(g)//2] if g else None,'P(gap<300)',round(sum(1 for x in g if x<300)/len(s),3))
print('growth'); prob(lambda r:r['growth'] if r['turn']>0 else None,[(-99,1),(1,2),(2,4),(4,8),(8,999)])
print('out'); prob(lambda r:r['out'],[(0,10),(10,100),(100,300),(300,600),(600,99999)])
print('L'); prob(lambda r:r['L'],[(1,3),(3,8),(8,16),(16,32),(32,64),(64,999)])
