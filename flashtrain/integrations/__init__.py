"""Optional integrations with other libraries (each imports its library only when imported itself)."""
