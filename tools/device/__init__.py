"""The device check on one NVIDIA GPU (``tools/device_check.sh``; README.md here)."""
