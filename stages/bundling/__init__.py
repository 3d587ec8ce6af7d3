"""What ships: which files go into a bundle, their sharded hashes, and the OMS manifest
that verify checks."""
