"""The operator's console and the developers' playground (`GET /console`)."""
