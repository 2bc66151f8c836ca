"""Top self and inclusive frames of a py-spy raw (collapsed) profile: python top_frames.py FILE."""
import collections
import sys

self_c, incl, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    frames = stack.split(";")
    total += n
    self_c[frames[-1]] += n
    for f in set(frames):
        incl[f] += n
print(f"samples {total}")
for f, n in self_c.most_common(15):
    print(f"self {100 * n / total:5.1f}%  {f[:150]}")
for f, n in incl.most_common(25):
    print(f"incl {100 * n / total:5.1f}%  {f[:150]}")
