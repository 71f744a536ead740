# Where each phase's time goes, block by block (docs/kernel-notes.md, "Version 1.14"): reads the
# raw profile marks of every block that a timeline build appends to $VOXKERNEL_TIMELINE (u64 pairs
# {%globaltimer ns, phase | SM << 16}, max_marks pairs per block, 256 blocks per launch; the host
# and kernel changes are described in the notes) and prints, per phase, the critical path split
# into the words' travel ("prop") and the work after them ("rest").
#   python3 scripts/gpu/timeline.py FILE LAUNCHES
import sys, collections
import numpy as np
path, launches = sys.argv[1], int(sys.argv[2])
GRID = 256
d = np.fromfile(path, dtype='<u8')
d = d.reshape(launches, GRID, -1, 2)
NAMES = {1: 'input', 2: 'qkv', 3: 'attn', 4: 'o', 5: 'gate_up', 6: 'down', 7: 'head', 8: 'sample'}
def name(ph):
    return ('t.' if ph & 16 else 'p.') + NAMES.get(ph & 15, str(ph & 15))
agg = collections.defaultdict(lambda: collections.defaultdict(list))
late_sm = collections.defaultdict(lambda: collections.defaultdict(list))
last_count = collections.defaultdict(collections.Counter)
frame_ns = []
for l in range(launches):
    blocks = []
    for b in range(GRID):
        m = d[l, b]
        n = int(np.argmax(m[:, 0] == 0)) if (m[:, 0] == 0).any() else len(m)
        if n == 0:
            break
        blocks.append(m[:n])
    nb = len(blocks)
    sm = np.array([int(bl[0, 1] >> 16) & 0xffff for bl in blocks])
    ends, waits, seqs = [], [], []
    for bl in blocks:
        ph = (bl[:, 1] & 0xffff).astype(np.int64)
        t = bl[:, 0].astype(np.int64)
        e, w, s = [], [], []
        pend = None
        for i in range(len(ph)):
            if ph[i] & 32:
                pend = t[i]
            else:
                e.append(t[i]); w.append(pend if pend is not None else -1); s.append(int(ph[i])); pend = None
        ends.append(e); waits.append(w); seqs.append(s)
    L0 = len(seqs[0])
    ok = all(s == seqs[0] for s in seqs)
    if not ok:
        lens = collections.Counter(len(s) for s in seqs)
        print(f'launch {l}: phase sequences differ between blocks: lengths {dict(lens)}')
        L0 = min(len(s) for s in seqs)
    E = np.array([e[:L0] for e in ends], dtype=np.float64).T  # [k][b]
    W = np.array([w[:L0] for w in waits], dtype=np.float64).T
    W[W < 0] = np.nan
    seq = seqs[0][:L0]
    t0 = E[0].min()
    frame_ns.append(E[-1].max() - t0)
    for k in range(1, L0):
        nm = name(seq[k])
        prev_last = E[k - 1].max()
        last = int(np.argmax(E[k]))
        a = agg[nm]
        a['crit'].append(E[k].max() - prev_last)
        a['spread_med'].append(E[k].max() - np.median(E[k]))
        srt = np.sort(E[k])
        a['gap2'].append(srt[-1] - srt[-2])
        a['min_to_max'].append(srt[-1] - srt[0])
        if not np.isnan(W[k][last]):
            a['last_prop'].append(W[k][last] - prev_last)
            a['last_rest'].append(E[k][last] - W[k][last])
        wk = W[k][~np.isnan(W[k])]
        if len(wk):
            a['med_prop'].append(np.median(wk) - prev_last)
            a['first_prop'].append(wk.min() - prev_last)
            rest = (E[k] - W[k])[~np.isnan(W[k])]
            a['med_rest'].append(np.median(rest))
            a['n_wait'].append(len(wk))
        last_count[nm][int(sm[last])] += 1
        med = np.median(E[k])
        for b in range(nb):
            late_sm[nm][int(sm[b])].append(E[k][b] - med)
print(f'frames: {len(frame_ns)}, span first start..last end, us: ' + ', '.join(f'{x/1e3:.1f}' for x in frame_ns))
print('per phase (us, mean over instances): n, crit (last end - previous last end), last block: prop + rest, '
      'median block: prop, rest; first prop; last - median end, last - 2nd, max - min; waiting blocks')
tot = 0.0
for nm in sorted(agg, key=lambda k: -np.sum(agg[k]['crit'])):
    a = agg[nm]
    f = lambda key: np.mean(a[key]) / 1e3 if a[key] else float('nan')
    n = len(a['crit']) / launches
    tot += np.sum(a['crit']) / launches
    print(f"{nm:10s} n {n:5.0f}  crit {f('crit'):5.2f}  last {f('last_prop'):5.2f}+{f('last_rest'):5.2f}  "
          f"med {f('med_prop'):5.2f}+{f('med_rest'):5.2f}  first {f('first_prop'):5.2f}  "
          f"late {f('spread_med'):5.2f} gap2 {f('gap2'):5.2f} range {f('min_to_max'):5.2f}  wait_n {np.mean(a['n_wait']) if a['n_wait'] else 0:4.0f}  "
          f"per frame {np.sum(a['crit'])/launches/1e3:7.1f}")
print(f'sum of crit per frame: {tot/1e3:.1f} us')
print('most often last (SM: count of instances), and the slowest / fastest SMs by mean lateness (us vs median):')
for nm in sorted(agg, key=lambda k: -np.sum(agg[k]['crit']))[:9]:
    lc = last_count[nm].most_common(5)
    ls = sorted(((np.mean(v), s) for s, v in late_sm[nm].items()), reverse=True)
    print(f"{nm:10s} last: {lc}  slow: {[(s, round(v/1e3, 2)) for v, s in ls[:6]]}  fast: {[(s, round(v/1e3, 2)) for v, s in ls[-3:]]}")
# is lateness a property of the SM? correlation of per-SM mean lateness between the two halves of the launches
for nm in ['p.gate_up', 'p.qkv', 'p.down', 'p.o']:
    if nm not in late_sm:
        continue
    sms = sorted(late_sm[nm])
    h1 = [np.mean(late_sm[nm][s][: len(late_sm[nm][s]) // 2]) for s in sms]
    h2 = [np.mean(late_sm[nm][s][len(late_sm[nm][s]) // 2:]) for s in sms]
    print(f'{nm}: per-SM lateness, first half vs second half of instances: r = {np.corrcoef(h1, h2)[0,1]:.2f}; '
          f'SM lateness std {np.std(h1)/1e3:.3f} us')
