"""What a pod needs: dependencies resolved for its fingerprint, installed once, and the env file."""
