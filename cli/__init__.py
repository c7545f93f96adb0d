"""The `jaxinfer` command line (click)."""
