"""The ground floor: errors, findings and verdicts, dtypes, atomic outputs, and the one registry helper every
extension seam uses. Imports nothing of the project."""
