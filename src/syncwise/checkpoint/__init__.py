"""syncwise.checkpoint"""
