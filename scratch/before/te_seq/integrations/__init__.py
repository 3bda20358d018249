"""Adapters to other libraries' models (imported on demand; nothing here runs on import)."""
