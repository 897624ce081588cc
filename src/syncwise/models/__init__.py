"""syncwise.models"""
