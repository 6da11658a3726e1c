"""Live recovery: a job that loses a server goes on without it, and takes in a server that joins.

membership.py  the control plane, made of parts that share a roster (roster.py: who is in):
               detector.py (heartbeats over UDP, fencing), agreement.py (the survivors' agreement
               on the next group: pure rules, and this rank's ballot), growth.py (joins);
               former.py forms the next group
recovery.py    the trainer's side: after a lost peer or a join, form the new group and go on
join.py        this rank's membership at start-up, or a new server joining a running job
status.py      each rank's progress record (its heartbeats carry it), and train.py --status
stopper.py     train.py --stop: a member asks for the job's stop as a first SIGTERM would
wire.py        the control messages, typed and signed; checks.py: their fields' checks
sockets.py     the card's address, and cutting gloo's connections at the end of a generation
"""
