"""Router repos on the Hub or on disk: saving, loading and pushing them, and their model card (`repos`)."""
