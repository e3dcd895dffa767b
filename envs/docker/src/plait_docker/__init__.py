"""plait-docker: untrusted programs run and graded inside Docker containers."""
