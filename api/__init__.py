"""FastAPI control plane: built in the control-plane issue."""
