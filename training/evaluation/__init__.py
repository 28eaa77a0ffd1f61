"""Evaluating on the training mesh: passkey retrieval (passkey.py), needle in a haystack (niah.py) and its heatmap,
with the rows and per-token scores they share (rows.py)."""
