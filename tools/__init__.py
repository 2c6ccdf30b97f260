"""Developer tools of the dcp_plus repository (not part of the installed package)."""
