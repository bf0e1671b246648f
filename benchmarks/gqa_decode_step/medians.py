import collections
import json
import statistics
import sys

rows = collections.defaultdict(list)
toks = collections.defaultdict(set)
for line in open(sys.argv[1]):
    parts = line.split(" ", 5)
    if len(parts) < 6 or not parts[5].startswith("{"):
        continue
    q, r, label, t, b, js = parts
    d = json.loads(js)
    rows[(q, t, b, label)].append(d)
    toks[(q, t, b, label)].add(tuple(d["tokens"]))
keys = sorted({k[:3] for k in rows})
labels = sys.argv[2].split(",")
print(
    "| quant | threads | batch | "
    + " | ".join(f"{label} wall / cpu ms" for label in labels)
    + " | "
    + " | ".join(f"genai/{label} (cpu)" for label in labels[1:])
    + " | rounds | same tokens |"
)
print("|" + "---|" * (4 + 2 * len(labels)))
for k in keys:
    med = {
        label: (
            statistics.median(d["wall_ms"] for d in rows[(*k, label)]),
            statistics.median(d["cpu_ms"] for d in rows[(*k, label)]),
        )
        for label in labels
        if rows[(*k, label)]
    }
    if len(med) < len(labels):
        continue
    same = len({next(iter(toks[(*k, label)])) for label in labels[1:]}) == 1
    print(
        f"| {k[0]} | {k[1][1:]} | {k[2][1:]} | "
        + " | ".join(f"{med[label][0]:.2f} / {med[label][1]:.2f}" for label in labels)
        + " | "
        + " | ".join(f"{med['genai'][1] / med[label][1]:.3f}" for label in labels[1:])
        + f" | {len(rows[(*k, labels[0])])} | {same} |"
    )
