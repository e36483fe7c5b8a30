"""Synthetic problems from the papers, generated in closed form (no download)."""
