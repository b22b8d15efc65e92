"""What the three roles share (metrics, tracing, energy, proto conversions, the worker server
skeleton, config -> CLI); see README.md here for what may import what."""
