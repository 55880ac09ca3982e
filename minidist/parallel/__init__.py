"""Parallel strategies, one file each: data.py (chapter 3), ... ."""
