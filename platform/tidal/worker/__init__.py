"""Code that runs inside each Ray Train worker (imports torch and deepspeed)."""
