"""What the test modules share (references, fixtures' writers, fake devices) and the scripts run beside them.

Imported as `helpers.<module>` (pytest puts tests/ on the path). The scripts (`gpu_flash_check.py`,
`make_tunix_fixtures.py`, `memory_probe.py`) run as `python tests/helpers/<script>.py`; their docstrings
have the commands.
"""
