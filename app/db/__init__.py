"""Database: declarative base, tables, engines and sessions."""
