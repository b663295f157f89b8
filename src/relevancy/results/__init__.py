"""The results and their rendering: Explanation classes, their parts, pictures and pages."""
