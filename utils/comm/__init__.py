"""The gradient sum: how one flat tensor is summed over every rank.

ring.py          the kernels: the two-pass ring and the bandwidth-optimal ring, plain functions
                 over one flat tensor, with drawings of their passes
hierarchical.py  ranks on the same server sum over loopback first, then a ring across servers
allreduce.py     one object per --allreduce (two-pass, ring, gloo, hierarchical): counts bytes,
                 draws the timeline
compress.py      what the sums carry (--compress none, bf16, fp16, powersgd)
names.py         the sum's names and defaults (torch-free): the command line reads them from here
"""
