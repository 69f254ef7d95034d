"""TOPLOC: proofs of what a worker computed, their verification, and the calibration of its thresholds."""
