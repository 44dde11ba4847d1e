"""The edge: settings, CLI, and (in later parts) the HTTP app and integrations."""
