"""Quantization: the ORT methods, calibration data, accuracy metrics and thresholds."""
