"""Wire types, datatypes, errors and codecs of the KServe v2 / Triton protocol (no Ray)."""
