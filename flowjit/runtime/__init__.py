"""The runtime: devices, buffers, executables and their execution."""
