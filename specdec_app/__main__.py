from specdec_app.cli import app

app()
