"""Triton's FIL backend (``backend: "fil"``): XGBoost, LightGBM and Treelite forests on the CPU."""
