import json, collections, math
reqs=[json.loads(l) for l in open('/work/shared/traces/mooncake_conversation_trace.jsonl')]
byk=collections.defaultdict(list)
for i,r in enumerate(reqs):
    ids=r['hash_ids']
    if len(ids)>1: byk[ids[1]].append(i)
pairs=[]
for l in byk.values():
    g=[b-a for a,b in zip(l,l[1:])]
    for a,b in zip(g,g[1:]): pairs.append((a,b))
print('pairs',len(pairs))
xs=[math.log(a) for a,b in pairs]; ys=[math.log(b) for a,b in pairs]
mx=sum(xs)/len(xs); my=sum(ys)/len(ys)
cov=sum((x-mx)*(y-my) for x,y in zip(xs,ys)); vx=sum((x-mx)**2 for x in xs); vy=sum((y-my)**2 for y in ys)
print('log corr', cov/math.sqrt(vx*vy))
for lo,hi in [(0,150),(150,300),(300,600),(600,1200),(1200,99999)]:
    s=sorted(b for a,b in pairs if lo<=a<hi)
    if s: print(lo,hi,len(s),'next gap p25/med/p75',s[len(s)//4],s[len(s)//2],s[3*len(s)//4])
# gap vs time: timestamps
ts=[r['timestamp'] for r in reqs]; print('duration ms',ts[-1], 'req/s',len(reqs)/(ts[-1]/1000))
# gap vs output_length of previous turn / input length
for lo,hi in [(0,100),(100,300),(300,600),(600,5000)]:
    s=sorted(l[j+1]-l[j] for l in byk.values() for j in range(len(l)-1) if lo<=reqs[l[j]]['output_length']<hi)
    if s: print('outlen',lo,hi,len(s),s[len(s)//4],s[len(s)//2],s[3*len(s)//4])
# min gaps overall
allg=sorted(b-a for l in byk.values() for a,b in zip(l,l[1:]))
print('gap pct 1,5,10', allg[len(allg)//100], allg[len(allg)//20], allg[len(allg)//10])
