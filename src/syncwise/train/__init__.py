"""syncwise.train"""
