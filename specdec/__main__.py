from specdec.cli import app

app()
