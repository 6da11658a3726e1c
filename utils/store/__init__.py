"""The files the program writes and reads.

checkpoint.py  the checkpoint (a plain dict) and the model file: save, load, check, restore
files.py       atomic writes; a device, FIFO or symlink the user names is written through
outputs.py     one output folder, one job: the lock files
"""
