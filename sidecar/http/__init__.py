"""The HTTP edge: the endpoints of the HTTP port (`admin.py`), the reference's extra listeners
(`side_ports.py`), whether the sidecar should receive traffic (`health.py`), and how every HTTP
port starts and stops (`listener.py`) and reads a body in time (`bodies.py`).
"""
