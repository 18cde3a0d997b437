"""The running sidecar: a list of parts (`parts.py`) built from its `Options` (`options.py`) by
`assembly.py`, started in order and stopped in reverse by the composition root (`app.py`);
`workers.py` runs several of them behind one address.
"""
