"""Search spaces for python -m falcon_lab.sweep (see docs/sweeps.md); a package so they ship in wheels."""
