"""The reference parallel trainer (torch TP + PP) and the parity runs."""
