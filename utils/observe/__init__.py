"""Watching a run.

report.py  what rank 0 prints: the start line, each epoch's line and metrics.jsonl, the slow-rank hint
watch.py   what a rank shows while it trains: its progress record, rank 0's reports
board.py   --tensorboard's event files
"""
