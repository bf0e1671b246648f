import collections
import json
import statistics
import sys

d = collections.defaultdict(dict)
seen = {}
for line in open(sys.argv[1]):
    p = line.split(" ", 5)
    if len(p) < 6 or not p[5].startswith("{"):
        continue
    q, r, label, t, b, js = p
    n = seen[(q, t, b, label)] = seen.get((q, t, b, label), 0) + 1
    d[(q, t, b)].setdefault(n, {})[label] = json.loads(js)
a, b_ = sys.argv[2], sys.argv[3]
for k, rounds in sorted(d.items()):
    for metric in ("cpu_ms", "wall_ms"):
        ratios = [v[a][metric] / v[b_][metric] for v in rounds.values() if a in v and b_ in v]
        print(
            k,
            metric,
            f"{a}/{b_} per-round: " + " ".join(f"{x:.2f}" for x in ratios),
            f"median {statistics.median(ratios):.3f}",
        )
