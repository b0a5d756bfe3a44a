"""The rank control plane, mirroring `tandem/serving/ranks/`."""
