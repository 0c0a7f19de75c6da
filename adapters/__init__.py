"""Framework backends behind one small contract (no Ray): see :mod:`rayinfer.adapters.base`."""
