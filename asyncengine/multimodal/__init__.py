"""Multimodal input: images loaded and checked (image_io.py), turned into encoder inputs and
placeholder tokens (processor.py). Front-end code: no torch is imported here."""
