"""Inference backends behind one small interface (base.py), chosen by name (registry.py)."""
