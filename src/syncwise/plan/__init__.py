"""syncwise.plan"""
