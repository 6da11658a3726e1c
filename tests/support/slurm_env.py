"""What Slurm hands a task, for the tests: a task's environment under srun (TASK), and Slurm's
compressed host lists with what Slurm's own parser makes of them (HOSTLISTS: what
tests/unit/test_slurm_environment.py expands and tests/world/test_scontrol.py checks against scontrol)."""

# One task of an srun step: rank 1 of 4, on the first of two nodes
TASK = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_JOB_ID": "4321",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[07-09]",
}

# Forms Slurm's own parser takes, with what it makes of them (scontrol show hostnames).
HOSTLISTS = {
    "node[01-03,07],gpu1": ["node01", "node02", "node03", "node07", "gpu1"],
    "rack[1-2]-n[8-10]": ["rack1-n8", "rack1-n9", "rack1-n10", "rack2-n8", "rack2-n9", "rack2-n10"],
    "n[08-10]": ["n08", "n09", "n10"],
    "n[010-012]": ["n010", "n011", "n012"],
    "a,b.example.org,c-1": ["a", "b.example.org", "c-1"],
    "n[1-2],m[3]": ["n1", "n2", "m3"],
    "rack[1-2]n[1-2]": ["rack1n1", "rack1n2", "rack2n1", "rack2n2"],
    "login1": ["login1"],
}
