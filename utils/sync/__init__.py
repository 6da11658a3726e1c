"""The gradient sync: what the training loop calls between loss.backward() and the next forward.

interface.py  GradientSync, the one interface every kind implements, DistributedOptimizer, and how
              the training thread waits for a sum on another thread (bounded once a peer is lost)
flags.py      Flags, what rides along with a step's sum (stop signals, a join, --balance's speeds)
              and the limits of its encoding
buckets.py    the sum in buckets: PlainSync (--no-overlap) and OverlappedSync (--overlap)
lazy.py       LazySync (--lazy-update): each bucket's update applied as the next forward needs it
periodic.py   PeriodicSync (--sync-every H): H local steps, then the change is averaged
factory.py    make_gradient_sync: the only place that reads the config's names
"""
