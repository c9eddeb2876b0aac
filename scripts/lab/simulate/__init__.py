"""The parts of dtlab-simulate, the alpha-beta-gamma cost model of training at scale:
links (presets and calibrated), the communication formulas, calibration from benchmark
JSON, the step model, the tables, and the validation against measured runs."""
